"""The database engines: one package each, holding all of that engine's SQL.

``sqlite`` (the embedded default) and ``postgres``. Each has the append path used by
``streamq.publish`` on the application's own connection (``append``), the schema
(``create_schema``), and the storage a serving producer uses.
"""
