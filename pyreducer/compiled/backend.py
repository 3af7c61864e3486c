"""The backend pyreducer puts around a user's torch.compile backend: it splits each captured graph
at the buckets of the plan in force (pyreducer/compiled/split.py) and compiles every piece with the
user's backend, so that backward hands each bucket's gradients over as it reaches them.

Note [Compiling the pieces]
Dynamo calls a backend once per captured graph, with fake example inputs, inside its tracing
context; the guards it installs afterwards include every shape guard the backend added to the graph's shape
environment. The pieces are compiled there and then, with the same fake mode (so dynamic shapes
stay dynamic and every guard a piece's compiler adds is checked by dynamo), one after another: each
piece's fake outputs are the next piece's example inputs. A compiler that goes through AOTAutograd
(inductor) may choose its outputs' strides; the first call of a piece compiled with
`fakify_first_call` set returns fake outputs with the strides the compiled code will produce, so the
next piece is compiled for what it will receive. Each piece is compiled in a tracing context of its
own (AOTAutograd keeps one forward's metadata per context, for the backward it compiles lazily);
guards AOTAutograd adds there are copied to dynamo's context.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch import fx

from pyreducer.compiled import split as split_module

log = logging.getLogger("pyreducer.compiled")


@dataclass
class GraphSplit:
    """What the backend did with one captured graph (for summaries and tests)."""
    pieces: int
    nodes: list[int]  # compute nodes per piece
    buckets: list[list[int]]  # per piece, the buckets whose first use opens it
    params: list[list[str]]  # per piece, those first uses (graph names)
    compiler: str = ""


@dataclass
class SplitBackend:
    """A dynamo backend: split at the buckets of `bucket_of`, compile each piece with `compiler`.

    Args:
        compiler: the user's backend as dynamo holds it (callable(gm, example_inputs)).
        bucket_of: id(parameter) -> bucket index, the plan in force when this backend was made;
            pyreducer/compiled/dynamo.py makes one backend per plan, so that a plan that changes
            which parameters share a bucket makes dynamo capture (and this backend split) again.
        params: the reduced parameters (kept to resolve ids only while they live).
        names: their names (for summaries), in the same order.
        aliases: () -> {id(tensor): parameter} for tensors the graph sees in place of reduced
            parameters (mixed_precision's low-precision copies), read while a graph compiles.
    """
    compiler: object
    bucket_of: dict
    params: list = field(default_factory=list, repr=False)
    names: list = field(default_factory=list, repr=False)
    aliases: object = dict
    splits: list = field(default_factory=list)  # GraphSplit per graph compiled

    def __post_init__(self):
        self._alive = weakref.WeakValueDictionary({id(p): p for p in self.params})
        self._name_of = {id(p): n for p, n in zip(self.params, self.names)}
        self._graph_names = {}  # graph input name -> parameter name
        self.params = []  # no strong reference from dynamo's caches to the model

    def __call__(self, gm: fx.GraphModule, example_inputs, **compiler_configs):
        cuts = split_module.plan_cuts(gm, self._param_key(gm), self.bucket_of)
        for cut in cuts:
            cut.params = [self._graph_names.get(p, p) for p in cut.params]
        record = GraphSplit(len(cuts), [c.end - c.start for c in cuts],
                            [c.buckets for c in cuts], [c.params for c in cuts],
                            compiler=getattr(self.compiler, "__name__",
                                             type(self.compiler).__name__))
        if len(cuts) <= 1:
            self.splits.append(record)
            return self.compiler(gm, example_inputs, **compiler_configs)
        split_gm = split_module.split(gm, cuts)
        _propagate_dynamo_metadata(gm, split_gm)
        _PieceCompiler(split_gm, self.compiler, example_inputs,
                       compiler_configs).run(*example_inputs)
        split_gm.recompile()
        self.splits.append(record)
        log.debug("split a graph of %d nodes into %d pieces at buckets %s",
                  sum(record.nodes), record.pieces, record.buckets)
        return split_gm

    def _param_key(self, gm):
        """node -> id of the reduced parameter it carries, or None (see split.first_uses)."""
        def key(node):
            if node.op == "get_attr":
                value = split_module.attribute(gm, str(node.target))
            else:
                grapharg = node.meta.get("grapharg")
                value = getattr(grapharg, "example", None) if grapharg is not None else None
            value = self.aliases().get(id(value), value)
            if isinstance(value, torch.Tensor) and self._alive.get(id(value)) is value:
                self._graph_names[str(node.target)] = self._name_of.get(id(value), node.target)
                return id(value)
            return None
        return key


def _propagate_dynamo_metadata(gm, split_gm):
    """Pieces keep the graph's dynamo metadata (what compilers read: the graph's compile id and
    sources of its inputs), as the captured graph had it."""
    sources = {n.name: getattr(n, "_dynamo_source", None)
               for n in gm.graph.nodes if n.op == "placeholder"}
    for name, module in split_gm.named_children():
        if isinstance(module, fx.GraphModule) and name.startswith("submod_"):
            module.meta = dict(gm.meta)
            if hasattr(gm, "_param_name_to_source"):
                module._param_name_to_source = gm._param_name_to_source
            for node in module.graph.nodes:
                if node.op == "placeholder":
                    node._dynamo_source = sources.get(node.name)


class _PieceCompiler(fx.Interpreter):
    """Runs the split graph on fake inputs, compiling each piece with the user's compiler as it
    is reached and replacing it by the compiled one (Note [Compiling the pieces])."""

    def __init__(self, split_gm, compiler, example_inputs, compiler_configs):
        super().__init__(split_gm)
        self.compiler = compiler
        self.configs = compiler_configs
        self.fake_mode = torch._guards.detect_fake_mode(example_inputs) \
            or torch._subclasses.fake_tensor.FakeTensorMode()
        self.outer = torch._guards.TracingContext.try_get()

    def run_node(self, node):
        if node.op != "call_module":
            return super().run_node(node)
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        assert not kwargs, f"split_module pieces take positional inputs only, found {kwargs}"
        args = [self._fake(a) for a in args]
        piece = self.fetch_attr(str(node.target))
        compiled, outputs = self._compile(piece, args)
        self.module.delete_submodule(str(node.target))
        node.target = f"compiled_{node.target}"
        self.module.add_submodule(str(node.target), compiled)
        return outputs

    def _fake(self, value):
        if isinstance(value, torch.Tensor) and \
                not isinstance(value, torch._subclasses.fake_tensor.FakeTensor):
            return self.fake_mode.from_tensor(value)
        return value

    def _compile(self, piece, args):
        """(callable, fake outputs) for one piece. A compiler's error propagates: dynamo then
        does what its settings say for a failed backend (raise, or run the frame eagerly)."""
        from torch._dynamo.utils import counters

        single = _ensure_tuple_output(piece)
        context = torch._guards.TracingContext(self.fake_mode)
        with torch._guards.tracing(context):
            context.fakify_first_call = True
            try:
                aot_calls = counters["aot_autograd"]["total"]
                compiled = self.compiler(piece, args, **self.configs)
                through_aot = counters["aot_autograd"]["total"] != aot_calls
                with self.fake_mode, \
                        mock.patch.object(self.fake_mode, "allow_non_fake_inputs", True):
                    # AOTAutograd's first call returns fakes with the compiled strides; another
                    # compiler's output is assumed to keep the graph's own (DDPOptimizer does
                    # the same)
                    outputs = compiled(*args) if through_aot else piece(*args)
            finally:
                context.fakify_first_call = False
        self._copy_guards(context)
        wrapper = _Piece(compiled, single)
        return wrapper, (outputs[0] if single and isinstance(outputs, (tuple, list)) else outputs)

    def _copy_guards(self, context):
        if self.outer is None:
            return
        self.outer.guards_context.aotautograd_guards.extend(
            context.guards_context.aotautograd_guards)


def _ensure_tuple_output(piece: fx.GraphModule) -> bool:
    """AOTAutograd compilers want a tuple (or list) output; a piece that returns one value is
    made to return a 1-tuple, unwrapped again by _Piece. Returns whether it was."""
    for node in piece.graph.nodes:
        if node.op == "output" and not isinstance(node.args[0], (tuple, list)):
            node.args = ((node.args[0],),)
            piece.recompile()
            return True
    return False


class _Piece(torch.nn.Module):
    """A compiled piece, called by the split graph with positional inputs."""

    def __init__(self, compiled, single: bool):
        super().__init__()
        self.compiled = compiled
        self.single = single

    def forward(self, *args):
        out = self.compiled(*args)
        return out[0] if self.single and isinstance(out, (tuple, list)) else out
