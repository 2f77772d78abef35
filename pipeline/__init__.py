"""charstream orchestration: config, stage graph, process supervision, tracing, CLI."""
