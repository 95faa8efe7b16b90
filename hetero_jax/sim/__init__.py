"""A discrete-event simulator of the host scheduler (pure Python, imports no jax).

Runs any policy of `hetero_jax.sched` against a step-time cost model (a roofline of an
A100-40GB or H200, or a linear model read from JSON) over a synthetic workload (mixed, or
groups sharing a prompt prefix), with one or more replicas behind a least-remaining-tokens
router, and the scheduler's own prefix cache on or off. `sim_main(argv)` in `cli.py` is the
CLI.
"""
from hetero_jax.sched.costmodel import (HARDWARE, MODELS, Hardware, LinearCostModel,
                                        ModelSpec, RooflineCostModel, StepShape, load_cost_model)
from hetero_jax.sim.report import format_table, percentile
from hetero_jax.sim.simulate import SimConfig, SimResult, Simulation, simulate
from hetero_jax.sim.workload import (WORKLOADS, LengthDist, RequestSpec, WorkloadConfig,
                                     request_specs)

__all__ = ["HARDWARE", "MODELS", "Hardware", "LinearCostModel", "ModelSpec",
           "RooflineCostModel", "StepShape", "load_cost_model", "SimConfig", "SimResult",
           "Simulation", "format_table", "percentile", "simulate", "LengthDist", "RequestSpec",
           "WORKLOADS", "WorkloadConfig", "request_specs"]
