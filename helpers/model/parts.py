"""What the interchangeable parts of the model share: each kind (feed-forward types, norms, position encodings) keeps
a registry, its GPTConfig field's name -> the class, and a part joins it only once it declares what the rest of the
code reads (`add_to_registry`)."""

from __future__ import annotations


def add_to_registry(part: type, base: type, registry: dict[str, type], field: str, declared: tuple[str, ...],
                    one_per_layout: bool = False) -> type:
    """Add `part` to `registry` under its `name`, after checking it: a subclass of `base` that declares `declared`
    and implements its abstract methods, with a name not taken (`field`: the GPTConfig field it names, for the
    messages). `one_per_layout`: a Hugging Face layout whose architecture fixes this kind of part (its norm, its
    position encoding) holds one at most, since config.json cannot say which."""
    missing = [attribute for attribute in declared if not hasattr(part, attribute)]
    missing += sorted(getattr(part, "__abstractmethods__", ()))
    if not issubclass(part, base) or missing:
        raise TypeError(f"{part.__name__} must subclass {base.__name__} and declare {', '.join(declared)} and its "
                        "methods" + (f"; missing: {', '.join(missing)}" if missing else ""))
    if part.name in registry:
        raise ValueError(f"{field} {part.name!r} is taken by {registry[part.name].__name__}; choose another name")
    for layout in part.hf_layouts if one_per_layout else ():
        held = part_in_layout(registry, layout)
        if held is not None:
            raise ValueError(f"the {layout} layout holds {field} {held.name!r} already, and its architecture has one; "
                             "leave it out of hf_layouts")
    registry[part.name] = part
    return part


def part_in_layout(registry: dict[str, type], layout: str) -> type | None:
    """The part of `registry` that a Hugging Face layout ("gpt2" or "llama") holds, for a kind the layout's
    architecture fixes (its norm, its position encoding), if one is registered."""
    return next((part for part in registry.values() if layout in part.hf_layouts), None)
