"""The keyword under which transformers hands a model its KV cache: `past_key_values` or `cache`.

transformers 5.24 renamed the decoders' `past_key_values` argument to `cache` (attention modules and
their forward hooks receive it under the new name too). The old name still works there, through
`deprecate_kwarg`, but warns with a FutureWarning on every call and is removed in 5.40; kvpress 0.5
runs under transformers < 5.3, which knows only the old name. So the name is decided here, once per
model class, from the signature of the forward the installed transformers defines; everything that
calls a model with a cache or reads one from keyword arguments goes through this module.

Imports nothing but the standard library: `kvpot.bench.kvpress_runner` uses it under transformers 5.2.
"""

from __future__ import annotations

import inspect

NEW_NAME = "cache"  # transformers >= 5.24
OLD_NAME = "past_key_values"  # transformers < 5.24 (a deprecated alias until 5.40)

_names: dict[type, str] = {}  # model class -> the keyword its forward takes


def cache_name(module) -> str:
    """The keyword `type(module).forward` takes the cache under (memoised per class: the hot
    decoding loop asks on every step)."""
    cls = type(module)
    name = _names.get(cls)
    if name is None:
        name = _names[cls] = NEW_NAME if NEW_NAME in _parameters(cls.forward) else OLD_NAME
    return name


def _parameters(forward) -> set[str]:
    """Parameter names of the undecorated forward: `deprecate_kwarg` wraps it with `functools.wraps`,
    whose wrapper takes `*args, **kwargs` and would hide both names."""
    return set(inspect.signature(inspect.unwrap(forward)).parameters)


def cache_kwargs(module, cache) -> dict:
    """`{name: cache}` to splat into a call of `module` (a decoder or a causal LM), under the name its
    installed transformers expects, so that no deprecation warning fires and 5.40 does not break it."""
    return {cache_name(module): cache}


def cache_from_kwargs(kwargs) -> object | None:
    """The cache among keyword arguments transformers passed on (a forward hook's `kwargs`, an
    attention function's `**kwargs`), whichever name the installed version uses; None if absent."""
    cache = kwargs.get(NEW_NAME)
    return kwargs.get(OLD_NAME) if cache is None else cache
