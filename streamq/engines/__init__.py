"""One module per database engine: the SQL that differs."""
