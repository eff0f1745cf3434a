"""The one piece every stand-in module shares: functions that raise when called."""

_MESSAGE = ("torchvision.{name} called: torchvision here is an import-only stand-in (tests/stubs) "
            "for vLLM's scheduler tests; nothing on that path may call it")


def module_getattr(module: str):
    """A module ``__getattr__``: any public name is a function that raises when called."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(_MESSAGE.format(name=f"{module}.{name}"))

        unavailable.__name__ = unavailable.__qualname__ = name
        return unavailable

    return __getattr__
