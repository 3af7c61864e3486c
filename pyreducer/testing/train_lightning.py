"""A small Lightning training run on 2 CPU processes (Gloo), with Lightning's own DDP strategy or
pyreducer's (tests/multirank/test_lightning.py runs it both ways and compares).

    python -m pyreducer.testing.train_lightning --strategy pyreducer --out run.pt \
        [--manual] [--accumulate 2] [--steps 12] [--save ckpt] [--resume ckpt] \
        [--ddp-options JSON] [--overlap] [--fp16-hook] [--optimizer adamw] [--scheduler] \
        [--clip-val 0.05 [--clip-algorithm value]] [--precision bf16-mixed] [--two-optimizers] [--grad-scaler]

--ddp-options: more DDPStrategy arguments (pyreducer's strategy: its overlap_optimizer= and
shard= too). --overlap: configure_optimizers returns an overlapped optimizer itself (refused).
--scheduler: a OneCycleLR stepped every optimizer step. --two-optimizers (with --manual): one
optimizer per layer, both stepped.

--fp16-hook: torch's fp16_compress_hook, through DDPStrategy(ddp_comm_hook=) for pyreducer's
strategy; Lightning's registers comm hooks on CUDA only, so for Lightning's own strategy a callback
registers it on torch DDP at fit start.

Lightning launches the second process itself (its "popen" launcher re-runs this command). Rank 0
writes {"losses": [...], "params": {name: tensor}} to --out.
"""
from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from pyreducer.wrapper import teardown


def _module_class(args):
    import lightning.pytorch as pl

    manual = args.manual

    class Regression(pl.LightningModule):
        """A 2-layer MLP on a fixed regression problem; SGD with momentum (or AdamW)."""

        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
            self.automatic_optimization = not manual
            self.losses = []

        def training_step(self, batch, index):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.detach().float().item())
            self.wrapper = type(self.trainer.strategy.model).__module__  # during fit: the wrapper
            if not manual:
                return loss
            opts = self.optimizers()
            opts = opts if isinstance(opts, list) else [opts]
            for opt in opts:
                opt.zero_grad()
            self.manual_backward(loss)
            for opt in opts:
                opt.step()
            if args.scheduler:
                self.lr_schedulers().step()
            return None

        def _optimizer(self, params):
            if args.optimizer == "adamw":
                return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)

        def configure_optimizers(self):
            if args.two_optimizers:
                return [self._optimizer(self.net[0].parameters()),
                        self._optimizer(self.net[2].parameters())]
            opt = self._optimizer(self.parameters())
            if args.overlap:  # refused by pyreducer's strategy (pyreducer/lightning.py)
                return self.trainer.strategy.model.overlap_optimizer(opt)
            if args.scheduler:
                scheduler = torch.optim.lr_scheduler.OneCycleLR(
                    opt, max_lr=0.05, total_steps=64)  # (a resumed run's too)
                return dict(optimizer=opt, lr_scheduler=dict(scheduler=scheduler,
                                                             interval="step"))
            return opt

    return Regression


def _data(samples: int = 512):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=gen)
    y = torch.tanh(x[:, :4] * 2) + 0.1 * torch.randn(samples, 4, generator=gen)
    return torch.utils.data.TensorDataset(x, y)


def _hook_at_fit_start(hook):
    import lightning.pytorch as pl

    class HookAtFitStart(pl.Callback):
        """Registers `hook` on the strategy's torch DDP (Lightning does so on CUDA only)."""

        def on_fit_start(self, trainer, pl_module):
            trainer.strategy.model.register_comm_hook(None, hook)

    return HookAtFitStart()


def _arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", choices=["torch", "pyreducer", "pyreducer_name"],
                        required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--manual", action="store_true")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps")
    parser.add_argument("--save", help="save a checkpoint here at the end")
    parser.add_argument("--resume", help="resume from this checkpoint")
    parser.add_argument("--ddp-options", default="{}", help="JSON: more DDPStrategy arguments")
    parser.add_argument("--overlap", action="store_true",
                        help="configure_optimizers returns an overlapped optimizer")
    parser.add_argument("--fp16-hook", action="store_true", help="torch's fp16_compress_hook")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    parser.add_argument("--scheduler", action="store_true", help="OneCycleLR, stepped per step")
    parser.add_argument("--clip-val", type=float, default=None, help="gradient_clip_val")
    parser.add_argument("--clip-algorithm", choices=["norm", "value"], default="norm")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--two-optimizers", action="store_true", help="one per layer")
    parser.add_argument("--grad-scaler", action="store_true",
                        help="fp16 autocast with a GradScaler (a precision plugin given as such: "
                             "on CPU Lightning turns precision='16-mixed' into bf16)")
    return parser.parse_args(argv)


def _strategy(args, callbacks: list):
    """The strategy asked for (a comm hook: its argument, or a callback for Lightning's)."""
    import lightning.pytorch as pl

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    options = json.loads(args.ddp_options)
    if args.fp16_hook and args.strategy == "torch":
        callbacks.append(_hook_at_fit_start(default_hooks.fp16_compress_hook))
    elif args.fp16_hook:
        options["ddp_comm_hook"] = default_hooks.fp16_compress_hook
    if args.strategy == "torch":
        return pl.strategies.DDPStrategy(process_group_backend="gloo", **options)
    import pyreducer.lightning  # (also registers the name)

    if args.strategy == "pyreducer":
        return pyreducer.lightning.DDPStrategy(process_group_backend="gloo", **options)
    return "pyreducer_ddp"


def main(argv=None) -> None:
    args = _arguments(argv)

    import lightning.pytorch as pl

    callbacks = []
    strategy = _strategy(args, callbacks)
    pl.seed_everything(0, workers=True)
    model = _module_class(args)()
    plugins = []
    if args.grad_scaler:
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
    loader = torch.utils.data.DataLoader(_data(), batch_size=16, shuffle=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps,
                         accumulate_grad_batches=1 if args.manual else args.accumulate,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True, callbacks=callbacks,
                         gradient_clip_val=args.clip_val, gradient_clip_algorithm=args.clip_algorithm,
                         precision=None if plugins else args.precision, plugins=plugins)
    trainer.fit(model, loader, ckpt_path=args.resume)
    # torch DDP's runs too: torch's Gloo threads can abort the process at exit, after the run
    # (pyreducer/wrapper/teardown.py; seen in CI on the Lightning oracle's run: exit -6,
    # "terminate called without an active exception"); pyreducer's wrapper registers this itself
    teardown.settle_gloo_threads_at_exit(torch.distributed.group.WORLD)
    if args.save:
        trainer.save_checkpoint(args.save)
    optimizer = trainer.strategy.optimizers[0] if trainer.strategy.optimizers else None
    history = getattr(optimizer, "history", {})  # an overlapped optimizer's last steps
    if trainer.global_rank == 0:
        torch.save(dict(losses=model.losses, wrapper=model.wrapper,
                        optimizer=type(optimizer).__name__,
                        updates_in_forward=sum(1 for step in history.values()
                                               for update in step["updates"]
                                               if update["module"] is not None),
                        params={k: v.detach().clone() for k, v in model.state_dict().items()}),
                   args.out)


if __name__ == "__main__":
    main()
