"""A small Lightning training run on 2 CPU processes (Gloo), with Lightning's own DDP strategy or
pyreducer's (tests/multirank/test_lightning.py runs it both ways and compares).

    python -m pyreducer.testing.train_lightning --strategy pyreducer --out run.pt \
        [--manual] [--accumulate 2] [--steps 12] [--save ckpt] [--resume ckpt] \
        [--ddp-options JSON] [--overlap] [--fp16-hook]

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


def _module_class(manual: bool, overlap: bool):
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        """A 2-layer MLP on a fixed regression problem; plain SGD with momentum."""

        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
            self.automatic_optimization = not manual
            self.losses = []

        def training_step(self, batch, index):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.detach().item())
            self.wrapper = type(self.trainer.strategy.model).__module__  # during fit: the wrapper
            if not manual:
                return loss
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return None

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
            if overlap:  # refused by pyreducer's strategy (pyreducer/lightning.py)
                return self.trainer.strategy.model.overlap_optimizer(opt)
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


def main(argv=None) -> None:
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
    args = parser.parse_args(argv)

    import lightning.pytorch as pl

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    options = json.loads(args.ddp_options)
    callbacks = []
    if args.fp16_hook and args.strategy == "torch":
        callbacks.append(_hook_at_fit_start(default_hooks.fp16_compress_hook))
    elif args.fp16_hook:
        options["ddp_comm_hook"] = default_hooks.fp16_compress_hook
    if args.strategy == "torch":
        strategy = pl.strategies.DDPStrategy(process_group_backend="gloo", **options)
    elif args.strategy == "pyreducer":
        import pyreducer.lightning

        strategy = pyreducer.lightning.DDPStrategy(process_group_backend="gloo", **options)
    else:
        import pyreducer.lightning  # noqa: F401: registers the name

        strategy = "pyreducer_ddp"
    pl.seed_everything(0, workers=True)
    model = _module_class(args.manual, args.overlap)()
    loader = torch.utils.data.DataLoader(_data(), batch_size=16, shuffle=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps,
                         accumulate_grad_batches=1 if args.manual else args.accumulate,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True, callbacks=callbacks)
    trainer.fit(model, loader, ckpt_path=args.resume)
    # torch DDP's runs too: torch's Gloo threads can abort the process at exit, after the run
    # (pyreducer/wrapper/teardown.py; seen in CI on the Lightning oracle's run: exit -6,
    # "terminate called without an active exception"); pyreducer's wrapper registers this itself
    teardown.settle_gloo_threads_at_exit(torch.distributed.group.WORLD)
    if args.save:
        trainer.save_checkpoint(args.save)
    if trainer.global_rank == 0:
        torch.save(dict(losses=model.losses, wrapper=model.wrapper,
                        params={k: v.detach().clone() for k, v in model.state_dict().items()}),
                   args.out)


if __name__ == "__main__":
    main()
