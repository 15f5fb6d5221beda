"""fp8mon for the Hugging Face ``transformers.Trainer``: one callback::

    from fp8mon.integrations.hf import Fp8monCallback

    trainer = Trainer(..., callbacks=[Fp8monCallback(url="http://127.0.0.1:8000", run="llama-fp8", every=10)])

The callback takes the Agent's keyword arguments (url, run, token, every, modules, sites, config, tags, ...) or a
ready ``agent=``. At train begin it makes the agent (run name: ``run=``, else $FP8MON_RUN, else ``args.run_name``
or the basename of ``args.output_dir``; config: ``TrainingArguments.to_dict()``'s JSON values under the given
``config``; tag ``framework=transformers``) and watches the model the Trainer hands its callbacks (the unwrapped
one: under DDP each rank watches its own replica and the agent reads the ranks from torch.distributed). At train
end it closes the agent with status "finished"; the Trainer tells callbacks of no exception, so a run that an
exception ends is closed "failed" at interpreter exit.

Steps: the agent's steps are the Trainer's optimizer steps numbered as ``state.global_step`` numbers them once the
step is done, the x-axis of the Trainer's own loggers (W&B, TensorBoard, ``log_history``): the first optimizer step
is step 1, a run of N steps reports steps 1..N. The Trainer raises ``global_step`` before ``on_step_end``, so
``on_step_begin`` declares step ``global_step + 1`` (``agent.step``) and ``on_step_end`` ends step ``global_step``
(``agent.log``). With gradient accumulation ``on_step_begin`` comes before the first micro-batch of an optimizer
step and ``on_step_end`` after its optimizer update: the statistics of all its micro-batches are that step's (the
grad_weight row is the accumulated gradient the optimizer used). The loss, grad_norm and learning rate reach
callbacks only in ``on_log`` (every ``logging_steps``), after ``on_step_end``: they are sent as scalars of the step
that was just closed, with the Trainer's numbers (its loss is the mean over the steps since the last log; lr is
named ``lr``); the other numbers of a log (epoch, eval_loss, train_runtime, ...) go along under their own names
(characters a scalar name cannot hold become "_").
With ``every=N`` statistics are sent on the steps that are multiples of N, the steps ``logging_steps=N`` logs.
Evaluation between steps runs the model in eval mode, which the agent's hooks ignore.
"""

from __future__ import annotations

import os
import re

from ._attach import Attachment, guarded, json_safe, run_name

try:
    from transformers import TrainerCallback
except ImportError as exc:  # the optional dependency
    raise ImportError("fp8mon.integrations.hf needs transformers: pip install 'fp8mon[hf]'") from exc

__all__ = ["Fp8monCallback"]

_RENAMED = {"learning_rate": "lr"}
_NOT_IN_SCALAR_NAMES = re.compile(r"[^A-Za-z0-9_./-]+")  # a metric named "eval BLEU" goes as "eval_BLEU"


class Fp8monCallback(TrainerCallback):
    """Attach an fp8mon Agent to a ``transformers.Trainer``: ``Trainer(..., callbacks=[Fp8monCallback(url=...,
    run=..., every=10)])``. Arguments: the Agent's keyword arguments, or ``agent=`` a ready Agent (watching the
    model already, or nothing yet), which the callback closes at train end too."""

    def __init__(self, *, agent=None, **agent_kwargs):
        self._attachment = Attachment("transformers", agent, agent_kwargs)
        self._sent: tuple[int, set[str]] = (-1, set())  # the scalars sent for the step last logged

    @property
    def agent(self):
        """The agent of the training in progress, or of the last one (closed); None before the first."""
        return self._attachment.agent

    def _live(self):
        return self._attachment.agent if self._attachment.live else None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("Fp8monCallback: the Trainer handed its callbacks no model")
        name = args.run_name if args.run_name and args.run_name != args.output_dir else None
        default = run_name(name, os.path.basename(os.path.normpath(str(args.output_dir or ""))), "transformers")
        agent = self._attachment.start(model, default, json_safe(args.to_dict()))
        agent.step(state.global_step + 1)  # a resumed run goes on from its checkpoint's step

    @guarded
    def on_step_begin(self, args, state, control, **kwargs):
        agent = self._live()
        if agent is not None:
            agent.step(state.global_step + 1)

    @guarded
    def on_step_end(self, args, state, control, **kwargs):
        agent = self._live()
        if agent is not None:
            agent.log(state.global_step)

    @guarded
    def on_log(self, args, state, control, logs=None, **kwargs):
        agent = self._live()
        if agent is None or not logs or state.global_step >= agent.current_step:
            return  # no step of this training is closed yet: nothing to attach them to
        if self._sent[0] != state.global_step:
            self._sent = (state.global_step, set())
        values = {}
        for key, value in logs.items():
            name = _RENAMED.get(key) or _NOT_IN_SCALAR_NAMES.sub("_", str(key)).lstrip("0123456789./-") or "_"
            # numbers (a NaN loss too), once per step: the end-of-training log repeats the last step's epoch
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name not in self._sent[1]:
                values[name] = value
        if values:
            self._sent[1].update(values)
            agent.log(state.global_step, **values)

    @guarded
    def on_train_end(self, args, state, control, **kwargs):
        self._attachment.finish("finished")
