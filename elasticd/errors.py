"""The one exception root of the daemon and the rendezvous plugin.

Third-party errors (etcd3/grpc, torch, OS) are translated to these at the
adapter that talks to them, and nowhere else.
"""


class ElasticdError(Exception):
    """Root of every error elasticd raises on purpose."""


class ConfigError(ElasticdError):
    """A configuration value is wrong; the message names the key, the value and the fix."""


class EtcdError(ElasticdError):
    """etcd refused or failed an operation."""


class EtcdUnavailable(EtcdError):
    """No etcd endpoint answered; the message lists the endpoints tried."""


class EtcdAuthError(EtcdError):
    """etcd rejected the credentials or the TLS handshake."""
