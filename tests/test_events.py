"""The learner's one event list: the recipe, its tasks and the callbacks subscribe to the same events, run in one
order, each hook once; `show_loop` prints that list; the parts the learner is built of share only declared state."""

import pytest
import torch

from dml_nb.blocks.models import build_backbone
from dml_nb.data.samplers import ClassBalancedBatchSampler
from dml_nb.methods.base import BaselineMethod, Task
from dml_nb.training.callbacks import EVENTS, Callback, EventList, Hook
from dml_nb.training.learner import Learner

torch.set_num_threads(min(2, torch.get_num_threads()))

CALLS: list = []


class Recipe(BaselineMethod):
    "A baseline whose hooks record when they run (`before_epoch` extends the baseline's own, `after_epoch` is new)."

    def before_epoch(self, ctx):
        super().before_epoch(ctx)
        CALLS.append(("method", "before_epoch", ctx.epoch))

    def after_epoch(self, ctx):
        CALLS.append(("method", "after_epoch", ctx.epoch))


def recording_task(task):
    "Give `task` hooks that record their calls (a subclass of its own class: its loss and miner stay)."

    class Recording(type(task)):
        def before_epoch(self, ctx):
            CALLS.append(("task", "before_epoch", ctx.epoch))

        def after_optimizer_step(self, ctx):
            CALLS.append(("task", "after_optimizer_step", ctx.global_step))

    task.__class__ = Recording
    return task


class Between(Callback):
    "Runs between the recipe (-30) and its tasks (-25) at `before_epoch`."

    order = -27

    def before_epoch(self, learner):
        CALLS.append(("callback", "before_epoch", learner.epoch))


def build(shapes, epochs=2, steps=2, callbacks=(), run_dir=None, **settings):
    train, _, test = shapes
    torch.manual_seed(0)
    m = Recipe(build_backbone("small_cnn", width=4, feature_dim=16), train.num_classes, embedding_dim=8)
    for t in m.tasks.values():
        recording_task(t)
    sampler = ClassBalancedBatchSampler(
        train.labels, batch_size=16, samples_per_class=4, seed=0, batches_per_epoch=steps
    )
    kw = dict(lr=1e-3, eval_sets={"test": test}, metrics=("recall@1",), progress=False, seed=3, run_dir=run_dir)
    kw.update(settings)
    return Learner(m, train, sampler, epochs=epochs, callbacks=list(callbacks), **kw)


def test_the_recipe_its_tasks_and_callbacks_run_once_each_in_one_order(shapes4):
    CALLS.clear()
    learn = build(shapes4, callbacks=[Between()])
    learn.fit()
    epoch0 = CALLS[: CALLS.index(("method", "after_epoch", 0)) + 1]
    assert epoch0 == [
        ("method", "before_epoch", 0),
        ("callback", "before_epoch", 0),  # order -27: after the recipe, before its tasks
        ("task", "before_epoch", 0),
        ("task", "after_optimizer_step", 0),  # the context's global step: the step is counted after the event
        ("task", "after_optimizer_step", 1),
        ("method", "after_epoch", 0),
    ]
    assert CALLS.count(("task", "before_epoch", 1)) == 1  # each task hook once: the recipe does not forward it too
    assert len([c for c in CALLS if c[1] == "after_optimizer_step"]) == 4
    assert (
        int(learn.method.steps_done) == learn.global_step == 4
    )  # the recipe's own after_optimizer_step ran at every step


def test_a_recipe_hook_called_directly_still_runs_its_tasks(shapes4):
    CALLS.clear()
    learn = build(shapes4)
    learn.prepare_fit()
    learn.method.before_epoch(learn.context)
    assert CALLS == [("task", "before_epoch", 0), ("method", "before_epoch", 0)]


def test_show_loop_lists_every_event_in_loop_order_with_its_hooks(shapes4, capsys):
    learn = build(shapes4, callbacks=[Between()])
    learn.show_loop()
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert [ln for ln in lines if not ln.startswith(" ")] == list(EVENTS)
    before_epoch = lines[lines.index("before_epoch") + 1 : lines.index("after_optimizer_step")]
    assert [ln.split()[:2] for ln in before_epoch] == [["-30", "method"], ["-27", "callback"], ["-25", "task"]]
    assert "Recipe.before_epoch" in before_epoch[0] and "Between.before_epoch" in before_epoch[1]
    after_epoch = lines[lines.index("after_epoch") + 1 : lines.index("after_fit")]
    names = [ln.split()[2] for ln in after_epoch]
    assert names[:2] == ["Recipe.after_epoch", "Learner:"] and names[2:] == [
        "EvalCallback.after_epoch",
        "CSVLogger.after_epoch",
        "EmptyTuplesStop.after_epoch",
        "CheckpointCallback.after_epoch",
    ]
    # the baseline's own forwarding hooks are not listed: they do nothing when the tasks run as their own entries
    assert "MultiTaskMethod.after_epoch" not in out and "MultiTaskMethod.before_fit" in out


def test_an_unknown_event_is_refused_with_the_list():
    with pytest.raises(ValueError, match="unknown event 'after_batch'.*before_fit, before_epoch"):
        EventList([Hook("after_batch", 0, "callback", "Mine.after_batch", lambda: None)])


def test_the_context_reads_the_epochs_logged_steps_from_the_declared_state(shapes4):
    seen = []

    class Probe(Callback):
        def after_step(self, learner, logs):
            seen.append(learner.context.logged_steps["loss"])

    build(shapes4, epochs=1, steps=3, callbacks=[Probe()]).fit()
    assert seen == [1, 2, 3]


def test_a_sampler_without_the_batch_source_methods_is_refused(shapes4):
    train, _, _ = shapes4

    class NoEpochs:
        def batches(self, epoch=None):
            return [[0, 1]]

    with pytest.raises(TypeError, match=r"set_epoch\(epoch\) and batches\(epoch\).*got NoEpochs"):
        Learner(
            BaselineMethod(build_backbone("small_cnn", width=4, feature_dim=16), None, embedding_dim=8),
            train,
            NoEpochs(),
        )


def test_a_resumed_run_fires_the_same_events_as_an_uninterrupted_one(shapes4, tmp_path):
    "Killed after a step of epoch 1 and resumed there: the same hooks run in the same order as in one fit."

    class Kill(Callback):
        order = 200  # after the checkpoint of the step

        def after_step(self, learner, logs):
            if (learner.epoch, learner.step) == (1, 1):
                raise KeyboardInterrupt

    CALLS.clear()
    build(shapes4, epochs=2, steps=2, run_dir=tmp_path / "ref").fit()
    ref = list(CALLS)
    CALLS.clear()
    with pytest.raises(KeyboardInterrupt):
        build(shapes4, epochs=2, steps=2, run_dir=tmp_path / "run", callbacks=[Kill()], checkpoint_every_steps=1).fit()
    first = list(CALLS)
    CALLS.clear()
    learn = build(shapes4, epochs=2, steps=2, run_dir=tmp_path / "run", checkpoint_every_steps=1)
    learn.fit()
    assert learn.resumed and first + CALLS == ref


@pytest.mark.parametrize(
    "base, old, new", [(BaselineMethod, "on_epoch_end", "after_epoch"), (Task, "on_fit_start", "before_fit")]
)
def test_a_hook_under_an_old_name_is_refused_with_its_new_name(base, old, new):
    "A recipe or a task whose hook has an older name (which the learner would never call) fails where it is defined."
    with pytest.raises(TypeError) as e:
        type("Mine", (base,), {old: lambda self, ctx: None})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"Mine.{old} is an old hook name that the learner never calls")
    assert f"rename it to {new}(self, ctx)" in msg


def test_a_task_hook_reads_the_recipe_from_the_context(shapes4):
    "A task's hooks have the recipe's signature, `hook(self, ctx)`; `ctx.method` is the recipe being trained."
    seen = []

    class Probe(Task):
        def before_fit(self, ctx):
            seen.append(ctx.method)

    learn = build(shapes4, epochs=1, steps=1)
    learn.method.tasks["discriminative"].__class__ = type(
        "Probing", (Probe, type(learn.method.tasks["discriminative"])), {}
    )
    learn.fit()
    assert seen == [learn.method]
