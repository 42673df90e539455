"""The operator's commands, read-only over a job's state: ``elasticd status`` (``status``),
``elasticd timeline`` (``timeline``: a job's history from its journal, as text, JSON or a
PNG) and ``elasticd doctor`` (``doctor``: a node's preflight). The daemon's loop imports
none of them; ``doctor.checkpoint_dir_failures`` is also the daemon's start-up check of
the checkpoint directory (``elasticd run``)."""
