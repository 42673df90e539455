"""The contract between the daemon (or the plugin's companion) and the workers: the
torch-free pieces both sides import, so that ``trainer`` and ``checkpointing`` need
nothing else of ``elasticd`` (``tests/test_layers.py`` checks it).

* ``settings``: the ``ELASTICD_*`` settings, defined once (the daemon writes them, the
  trainer reads them), the recovery mode;
* ``generation``: a generation ``(epoch, round, seq)``, its record and the one file format
  the daemon hands to the workers;
* ``progress``: the workers' progress record, its event names and schema;
* ``pids``: whether a process is alive;
* ``files``: how the files both sides exchange are written (replaced whole).
"""
