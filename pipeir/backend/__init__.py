"""The backend: lowering to per-rank instruction programs (`lower`), the communication
deadlock proof (`commcheck`), Python code generation (`codegen`) and the `driver` that chains
them with passes. Nothing here imports torch; `pipeir.runtime` executes what this produces."""
