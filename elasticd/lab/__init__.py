"""Lab tooling: several nodes and a throw-away etcd on one machine, for the demo, the tests,
the benchmarks and the chaos harness. No runtime module imports it (the daemon, the
rendezvous plugin and the in-place protocol run without it: ``tests/test_layers.py``);
``elasticd demo`` and ``elasticd chaos`` import it when they run.

* ``embedded_etcd``: one etcd member or a 3-member cluster as child processes;
* ``local_cluster``: daemon or torchrun nodes over one etcd, and their cleanup;
* ``netlab``: network namespaces, veth pairs and tc/iptables faults (root);
* ``fake_metadata``: a fake GCE / AWS / Azure metadata service on 127.0.0.1;
* ``demo``: ``elasticd demo``; ``chaos``: the chaos harness (``elasticd chaos``).
"""
