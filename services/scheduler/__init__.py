"""The farm's scheduler service, which runs the search engine (`tunefarm.search`) for
every job: `service.py` (the process, `tunefarm scheduler`), `farm_job.py` (one job's
session), `shared_model.py` (one cost model per device class), `farm_measurer.py`
(measuring through the farm), `model_check.py` (a tuned model checked on a device of its
class), `settings.py`, `exceptions.py`. Its database work is in `services.db`
(`job_store`, `job_locks`, `farm_batches`, `farm_tasks`, `class_models`, `model_checks`).
"""
