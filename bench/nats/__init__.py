"""NATS JetStream, the second baseline: a throwaway nats-server (``server``) and the
nats-py client settings its benchmark processes share (``clients``)."""
