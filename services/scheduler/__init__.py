"""The search engine: sketch rules, annotation, evolution, cost model, tuner.

And the farm's scheduler service, which runs that same search for every job:
`service.py` (the process, `tunefarm scheduler`), `farm_job.py` (one job's session),
`shared_model.py` (one cost model per device class), `job_store.py` (its database work),
`farm_measurer.py` (measuring through the farm), `settings.py`, `exceptions.py`.
"""
