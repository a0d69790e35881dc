"""Executors: one per kind of parallelism, each on the shared recovery core
(``runtime/recovery.py``) and each implementing its protocol (``protocol.py``): how a step of
its plan is computed and committed, and how a Decision is carried out.

* ``dp``        data parallelism: every worker holds the whole model
* ``pipeline/`` DP x PP: unequal pipelines, 1F1B over point-to-point messages, migration
* ``sharded/``  FSDP2 / HSDP: rows of shards, buddy snapshots, heal / recompute / rehabilitate
"""
