"""The search engine: tunefarm's own Ansor-style auto-scheduler, a library that embedded
mode (`tunefarm tune`, `tune-op`) and the farm's scheduler service both drive.

Where things are:
- `space/`: what a task's programs can be. `dag` analyses a workload's compute DAG,
  `rule_set` picks the derivation rules for a target, `sketch` (CPU) and `sketch_gpu`
  derive the sketches, `slots` and `program_space` annotate them at random, `loopnest`
  (CPU) and `loopnest_gpu` model a program's loop nest without TVM (validity, features),
  `realize` turns a program into TVM schedule primitives.
- `evolution`: the evolutionary search over annotated programs (Ansor §5.1).
- `features`: the per-statement features of a program (Ansor §5.2).
- `cost_model/`: the learned XGBoost model (`xgb`), its interface (`base`), a random
  stand-in (`random_model`), ranking metrics, the on-disk cache of embedded runs
  (`cache`) and transfer between device classes (`transfer`).
- `task_scheduler/`: which task gets the next round (Ansor §6: gradient, round-robin).
- `tuner`: one task's search loop (propose -> measure -> learn); `session`: a run over
  many tasks (the task scheduler, the shared cost model, the measurer); `task`: a
  workload on a target as the search sees it; `similar_programs`: seeding a task from
  the best programs of similar ones; `config`: the search's settings.

The engine imports nothing from `services` or `tunefarm_app`: what it measures with is a
`tunefarm.measure.Measurer`, local processes or the farm.
"""
