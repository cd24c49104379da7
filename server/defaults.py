"""Defaults that both the config file's schema (`server.config`) and the command line (`server.cli`,
`server.cluster`) state: kept here, free of the runtime's imports, so the CLI can name them in its help."""

HOST = "127.0.0.1"  # the server binds to loopback unless told otherwise
PORT = 8000
CLUSTER_REPLICAS = 2
