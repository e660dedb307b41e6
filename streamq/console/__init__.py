"""``streamq console``: one web page over producers and consumer databases (streams,
consumers and their lag, groups, dead letters, capture, a stream's newest records).
``watch`` gathers, ``app`` serves; the page is ``static/``."""
