"""The wire: streamq's TCP under the producer's server, the consumer and the client.

Owns the connection plumbing (``transport``: addresses, connecting, reading and writing
frames with ``protocol``), TLS and token authentication (``security``), and the blocking
client for requests (``client``: heads, ranges, stream lists, status), which the CLI and
the Spark source use.

May import: ``protocol`` and the shared modules at the top (``errors``, ``filters``,
``records``). Never the producer's or the consumer's side, groups or engines.
"""
