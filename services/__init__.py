"""tunefarm services: scheduler (search engine), worker (build), measurer (run), api (HTTP)."""
