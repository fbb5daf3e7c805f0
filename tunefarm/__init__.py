"""tunefarm: an Ansor-style auto-scheduler for tensor programs.

The search engine lives in `services.scheduler`; building in `services.worker`; running
on a device in `services.measurer`. This package holds what all of them share: the
workload definitions, the plain records that cross process boundaries, the record
store, target detection and the command line.
"""

__version__ = "0.1.0"
