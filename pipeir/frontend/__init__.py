"""Front end: `.sched` text -> syntax tree (`parser`, `ast`) -> Schedule IR (`elaborate`).

Elaboration is in parts: `scope` (names, values, the run context), `expressions` and
`statements` (syntax -> closures), `pipeline` (settings -> PipelineConfig), and `elaborate`,
which picks the schedule and runs it.
"""
