"""The search engine: sketch rules, annotation, evolution, cost model, tuner."""
