"""The pipeline (DP x PP) executor: ``executor.PipelineExecutor`` on the recovery core;
``schedule`` (routes of micro-batches through stages, 1F1B orders), ``step`` (one step's
point-to-point run), ``migration`` (moving blocks and optimizer state in the migration plan's
rounds), ``calibration`` (the engine's measured feed).  See docs/runtime-pipeline.md."""
