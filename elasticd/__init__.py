"""elasticd: a fault-tolerant elastic training daemon on torchrun and etcd v3.

Kept import-light on purpose: torchrun loads the rendezvous entry point of this
package at start-up, and an eager import of the daemon here would slow every
agent and risk circular imports at registration.
"""

__version__ = "0.1.0"
