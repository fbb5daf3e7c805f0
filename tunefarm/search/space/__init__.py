"""A task's search space: the compute DAG (`dag`), the derivation rules (`rule_set`,
`sketch`, `sketch_gpu`), random annotation (`slots`, `program_space`), the loop-nest
model (`loopnest`, `loopnest_gpu`) and the realization as TVM schedule primitives
(`realize`)."""
