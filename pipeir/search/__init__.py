"""Searching for schedules, above the passes: `tune` ranks the library's schedules (with
the passes that fit them) under a cost model, and `synth` constructs one with a constraint
solver. Both run passes and the simulator; nothing below this package imports it (the
`synth` pass, `synth_pass`, reaches the pipeline through the pass registry's lazy
"module:Class" loader, as plugins do).
"""
