"""Building candidates into kernels: local worker processes (`builder.py`) and the farm's
RQ build job `jobs.build_batch` with its `tunefarm worker` entry (`jobs.main`)."""
