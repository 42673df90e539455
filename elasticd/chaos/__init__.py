"""The chaos harness (see elasticd/chaos/run.py). ``faults`` is imported first: it
registers the injectors of ``cluster_faults``, which subclass its ``Injector``."""

from elasticd.chaos import faults  # noqa: F401
