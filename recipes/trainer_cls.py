"""Sequence-classification fine-tuning of all-MiniLM-L6-v2 with the HuggingFace Trainer, offline.

    python recipes/trainer_cls.py --workers 4 --kill-rank 2 --at-step 5

The ``seq_cls.py`` task (same model, data and batches) written as a ``transformers.Trainer``
script whose one changed line is the class: ``FaultTolerantTrainer`` (``transformers_ft``).
``TrainingArguments``: AdamW, linear schedule, gradient accumulation 2, ``eval_strategy="steps"``,
checkpoints with ``save_total_limit=2`` and ``load_best_model_at_end``.  Ends with ``eval
accuracy`` of the best model (``trainer.evaluate()``, every sample once).
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from seq_cls import cls_start  # noqa: E402


def main():
    a, path, train_rows, eval_rows, labels, collate = cls_start(__doc__, __file__)
    import numpy as np
    from transformers import AutoModelForSequenceClassification, TrainingArguments

    from transformers_ft import FaultTolerantTrainer  # was: from transformers import Trainer

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=len(labels))
    out = a.out or "."
    steps = max(1, len(train_rows) // (a.batch_size * 2 * a.workers))
    args = TrainingArguments(
        output_dir=os.path.join(out, "checkpoints"), per_device_train_batch_size=a.batch_size,
        per_device_eval_batch_size=16, gradient_accumulation_steps=2, num_train_epochs=a.epochs,
        learning_rate=5e-5, lr_scheduler_type="linear", logging_steps=2, eval_strategy="steps",
        eval_steps=max(2, steps // 2), save_strategy="steps", save_steps=max(2, steps // 2), save_total_limit=2,
        load_best_model_at_end=True, metric_for_best_model="accuracy", use_cpu=True, report_to="none",
        seed=a.seed, disable_tqdm=True, remove_unused_columns=False)

    def accuracy(pred):
        return {"accuracy": float(np.mean(pred.predictions.argmax(-1) == pred.label_ids))}

    trainer = FaultTolerantTrainer(model=model, args=args, train_dataset=train_rows, eval_dataset=eval_rows,
                                   data_collator=collate, compute_metrics=accuracy)
    t0 = time.perf_counter()
    trainer.train()
    metrics = trainer.evaluate()
    ctx = trainer.accelerator.ft_context
    if trainer.is_world_process_zero():
        print(f"recipe: done in {time.perf_counter() - t0:.1f} s, global_step {trainer.state.global_step}, "
              f"recoveries {ctx.recoveries if ctx else 0}; eval accuracy {metrics['eval_accuracy']:.4f}", flush=True)
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"eval_accuracy": metrics["eval_accuracy"], "eval_loss": metrics["eval_loss"],
                       "steps": trainer.state.global_step, "workers": trainer.accelerator.num_processes,
                       "recoveries": ctx.recoveries if ctx else 0,
                       "log_history": trainer.state.log_history}, f)


if __name__ == "__main__":
    main()
