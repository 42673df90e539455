"""The chaos harness (see elasticd/lab/chaos/run.py). ``faults`` is imported first: it
registers the injectors of ``cluster_faults``, which subclass its ``Injector``."""

from elasticd.lab.chaos import faults  # noqa: F401
