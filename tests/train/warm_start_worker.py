"""A warm start on the real tiny policy (one gloo rank, CPU) that receives SIGTERM from itself
after its step STOP_AT, as `kill` or SLURM sends it; run in a subprocess by
test_warm_start_stop.py so Megatron's global state and the signal handler stay out of pytest.

    python warm_start_worker.py OUTPUT_DIR OUT.json
"""

import functools
import json
import os
import signal
import sys
import tempfile

STEPS, STOP_AT = 40, 3


class Console:
    def __init__(self):
        self.lines = []

    def message(self, text):
        self.lines.append(text)


def main(output_dir: str) -> dict:
    from transformers import AutoTokenizer

    from megatron_rl.checkpoint.format import write_run_tokenizer
    from megatron_rl.config import load_config
    from megatron_rl.data import load_datasets
    from megatron_rl.model.policy import Policy
    from megatron_rl.runtime import start_runtime
    from megatron_rl.train.stop_signals import StopSignals
    from megatron_rl.train.warm_start import WarmStartStopped, warm_start

    config = load_config(None, ["device=cpu", f"warm_start.steps={STEPS}", "warm_start.batch_size=8",
                                "data.num_train=64", f"output_dir={output_dir}"])
    train_set, _ = load_datasets(config.data)
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        write_run_tokenizer(config, tokenizer_dir)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    runtime = start_runtime(config)
    policy = Policy(config, runtime)
    signals = StopSignals()
    signals.install()  # as Trainer.run does before its warm start
    trained = []

    def on_step(step, result):
        trained.append(step)
        if step == STOP_AT:
            os.kill(os.getpid(), signal.SIGTERM)

    console, stopped = Console(), None
    try:
        warm_start(policy, tokenizer, train_set, config, runtime, console, on_step=on_step,
                   stop=functools.partial(signals.requested, runtime))
    except WarmStartStopped as exc:
        stopped = {"signal": exc.signal_name, "step": exc.step, "total": exc.total, "text": str(exc)}
    runtime.shutdown()
    return {"trained": trained, "stopped": stopped, "lines": console.lines}


if __name__ == "__main__":
    result = main(sys.argv[1])
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)
