"""fla's Triton kernels on a CPU, through Triton's interpreter (`TRITON_INTERPRET=1`; docs/gpu.md).

The interpreter runs `@triton.jit` kernels with numpy on CPU tensors, block by block, so the GPU code path of
every fla-wired mixer (layouts, gate signs, scales, dtype casts, initial states, chunk sizes, the host-side
asserts fla makes before a launch) executes on a machine without a GPU. fla 0.6.0's kernels need three
accommodations there, each for something the interpreter lacks, and a fourth for its speed; `accommodate()` applies
them once per process, only when the interpreter is on (`interpreting()`), and nothing here runs on a GPU:

1. no device to benchmark on: the autotuner asks the active driver for a benchmarker ("0 active drivers").
   Every autotuned kernel runs its first (pruned) config instead; the result does not depend on the config.
2. loop indices are Python ints: in compiled Triton `for i in range(n)` hands the body a tensor, so fla calls
   `i.to(tl.int64)` on it (`chunk_fwd_kernel_h`); the interpreter runs the loop as Python. The interpreter's
   own source rewrite (it already wraps every assignment in `to_tensor`) also wraps the index of each
   `range` loop.
3. builtins taken by name: the interpreter swaps `tl.gather` for its numpy version inside `triton.language`
   while a kernel runs, but fla's modules bound `gather = tl.gather` at import (`fla.ops.utils.op`), so they
   call the compiled builtin (`_semantic` argument must be provided outside of JIT functions); RWKV-7's DPLR
   kernels use it. Those names are pointed at a function that looks `tl.gather` up when called.
4. speed: the interpreter patches triton.language for each kernel launch and again for each call of a
   `@triton.jit` helper inside it (the same modules, never restored); inside a launch the helper's patch is skipped.

What the interpreter cannot do: bf16 (numpy has none: results are off by orders of magnitude), so ops/dispatch.py
refuses `model.impl=fla` in bf16 under the interpreter. It is slow (seconds per op call at T = 64): a check
route, not a way to train.
"""
from __future__ import annotations

import ast
import os
import sys

ENV = "TRITON_INTERPRET"
_DONE: list[bool] = []


def interpreting() -> bool:
    """Triton's interpreter is on for this process (Triton reads the same variable, with the same truth values)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "on", "yes")


def accommodate() -> None:
    """Apply the accommodations above (idempotent). Imports triton and fla: call it only when interpreting."""
    if _DONE:
        return
    if not interpreting():
        raise RuntimeError(f"{ENV} is not set: the interpreter's accommodations apply under the interpreter only")
    from triton.runtime import autotuner, interpreter

    # 1. one config per autotuned kernel (no device to time the others on)
    prune = autotuner.Autotuner.prune_configs

    def first_config(self, kwargs):
        return prune(self, kwargs)[:1]

    autotuner.Autotuner.prune_configs = first_config

    # 2. `for i in range(...)`: i as an interpreter tensor, as compiled Triton hands it over
    class LoopIndexAsTensor(interpreter.ASTTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            it, target = node.iter, node.target
            if (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"
                    and isinstance(target, ast.Name)):
                to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                          ctx=ast.Load())
                wrap = ast.Assign(targets=[ast.Name(id=target.id, ctx=ast.Store())],
                                  value=ast.Call(func=to_tensor, args=[ast.Name(id=target.id, ctx=ast.Load()),
                                                                       ast.Constant(value=False)], keywords=[]))
                node.body.insert(0, ast.fix_missing_locations(ast.copy_location(wrap, node)))
            return node

    interpreter.FunctionRewriter.ast_transformer = LoopIndexAsTensor()

    # 3. fla's `gather = tl.gather` bindings: look the (patched) builtin up at call time
    import triton.language as tl

    import fla.ops.utils.op as fla_op

    compiled_gather = tl.gather

    def gather(src, index, axis, **_):
        return tl.gather(src, index, axis)

    fla_op.gather = gather  # modules imported from now on take this one
    for name, module in list(sys.modules.items()):
        if name.startswith("fla.") and getattr(module, "gather", None) is compiled_gather:
            module.gather = gather

    # 4. the language patched once per launch: a kernel launch patches the language modules its globals hold
    #    (triton.language, triton.language.core) for its run and restores them after, and every call of a
    #    @triton.jit helper inside it patched its own modules again (inspect.getmembers over each, per call: a
    #    quarter of a KDA backward's time), its scope never restored. Inside a launch a helper now patches only the
    #    modules this launch has not (e.g. tl.core, which triton.language.standard's helpers call), restored with it.
    patch_lang, launches = interpreter._patch_lang, []

    def langs(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_once(fn):
        mine = langs(fn)
        if launches:  # a helper called inside a running launch
            patched, scopes = launches[-1]
            if not mine <= patched:
                patched |= mine
                scopes.append(patch_lang(fn))
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)
        launches.append((mine, [scope]))
        restore = scope.restore

        def restore_and_end():
            _, scopes = launches.pop()
            for inner in reversed(scopes[1:]):
                inner.restore()
            restore()
        scope.restore = restore_and_end
        return scope

    interpreter._patch_lang = patch_once
    _DONE.append(True)
