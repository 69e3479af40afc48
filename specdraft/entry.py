"""What every entry point shares (`train.py`, `distill.py`, `evaluate.py`, the `specdraft-*` scripts).

- `launch(main)` runs a `@hydra.main` function: registers the schemas, keeps Hydra quiet on ranks > 0, and
  adds the `ValidateConfig` callback, which checks the composed config's ranges (conf/validate.py) before
  Hydra creates the run dir or writes anything into it.
- `run_stage(stage, cfg)` calls the stage inside `reported_errors()`: the project's own errors (bad input,
  missing files) print as one line `error: <message>` on stderr and exit with code 2, no traceback.
  `SPECDRAFT_DEBUG=1` (or Hydra's `HYDRA_FULL_ERROR=1`) re-raises them with the full traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from specdraft.conf.schema import register_configs
from specdraft.conf.validate import validate_config
from specdraft.utils import env_rank, quiet_hydra_on_nonzero_rank

T = TypeVar("T")
EXIT_CODE = 2  # bad input (as argparse)


class SpecdraftError(Exception):
    """A problem with the user's input or files that one line explains (reported without a traceback)."""


USER_ERRORS: tuple[type[BaseException], ...] = (
    SpecdraftError,
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
)
VALIDATE_OVERRIDE = f"++hydra.callbacks.specdraft_validate._target_={__name__}.ValidateConfig"


def debug_enabled() -> bool:
    """Whether `SPECDRAFT_DEBUG` or `HYDRA_FULL_ERROR` asks for full tracebacks."""
    return any(os.environ.get(k, "") not in ("", "0") for k in ("SPECDRAFT_DEBUG", "HYDRA_FULL_ERROR"))


def _raised_outside_specdraft(e: BaseException) -> str | None:
    """`module:line` of the innermost frame when that is not specdraft's code (e.g. a ValueError from torch)."""
    if isinstance(e, SpecdraftError):
        return None
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return None
    module = str(tb.tb_frame.f_globals.get("__name__", ""))
    if module == "__main__" or module.split(".")[0] == "specdraft":
        return None
    return f"{module or tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"


def report(e: BaseException) -> NoReturn:
    """Print `e` as one line `error: <message>` on stderr and exit with `EXIT_CODE`.

    An error raised inside a library (not specdraft's own check) also names where, and how to see more.
    """
    message = " ".join(str(e).split()) or type(e).__name__  # one line, whatever the message holds
    where = _raised_outside_specdraft(e)
    if where is not None:
        message = f"{type(e).__name__}: {message} (raised in {where}; SPECDRAFT_DEBUG=1 shows the traceback)"
    rank = env_rank()
    print(f"error{f' (rank {rank})' if rank else ''}: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_CODE)


@contextmanager
def reported_errors() -> Iterator[None]:
    """Report the project's errors (`USER_ERRORS`) as one line and exit 2, unless `debug_enabled()`."""
    try:
        yield
    except USER_ERRORS as e:
        if debug_enabled():
            raise
        report(e)


class ValidateConfig(Callback):
    """Hydra callback: check the composed config's ranges before Hydra creates or writes the run dir."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Validate a single run's config (called before the run dir exists)."""
        try:
            validate_config(config)
        except USER_ERRORS as e:  # Hydra turns a callback's exception into a warning: exit here
            if debug_enabled():
                traceback.print_exc()
            report(e)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Validate a sweep's base config (each job's stage validates its own values again)."""
        self.on_run_start(config)


def run_stage(stage: Callable[[DictConfig], T], cfg: DictConfig) -> T:
    """Call `stage(cfg)` (the body of a `@hydra.main` function) with the project's errors reported in one line."""
    with reported_errors():
        return stage(cfg)


def launch(main: Callable[[], Any]) -> None:
    """Run the `@hydra.main`-decorated `main` as a specdraft entry point.

    Registers the config schemas, keeps Hydra's files and logs on rank 0 (`quiet_hydra_on_nonzero_rank`) and
    adds the `ValidateConfig` callback (a `hydra.callbacks` override, so nothing is written for a bad config).
    """
    if debug_enabled():
        os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra prints the full traceback of re-raised errors too
    register_configs()
    quiet_hydra_on_nonzero_rank()
    _add_override(VALIDATE_OVERRIDE)
    main()


def _add_override(override: str) -> None:
    """Put a Hydra override into sys.argv next to the user's (argparse reads the overrides as one run)."""
    from hydra._internal.utils import get_args_parser

    given = get_args_parser().parse_known_args(sys.argv[1:])[0].overrides
    sys.argv.insert(sys.argv.index(given[0], 1) if given else len(sys.argv), override)
