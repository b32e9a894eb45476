"""Goodput, heterogeneity, scavenging, bandwidth and deployment planning at data-centre scale.

Facade of the simulator package; the command line is :mod:`ddiloco_geo.cli.simulate`.

- :mod:`.goodput`      what failures cost dp / elastic_dp / ddiloco (closed forms, first principles)
- :mod:`.calibrate`    the two unknown constants from the paper's two headline cells
- :mod:`.sensitivity`  each constant ±50% → change of every grid cell
- :mod:`.failures`     seeded traces and an event simulation that checks the closed forms
- :mod:`.hetero`       4 full-speed + 4 slower learners, K=M vs K=1 vs K=1+grace
- :mod:`.scavenge`     part-time extra learners vs a DP job that must reconfigure
- :mod:`.bandwidth`    WAN bandwidth per learner for utilization targets, bytes and egress $
- :mod:`.chart`        PNG charts of the tables
"""

from ddiloco_geo.tools.sim.bandwidth import BandwidthModel, bandwidth_rows
from ddiloco_geo.tools.sim.calibrate import calibrate
from ddiloco_geo.tools.sim.goodput import ClusterModel, simulate_grid
from ddiloco_geo.tools.sim.hetero import HeteroConfig, simulate_hetero
from ddiloco_geo.tools.sim.scavenge import ScavengeConfig, scavenge_rows
from ddiloco_geo.tools.sim.sensitivity import sensitivity_rows

__all__ = ["simulate_grid", "calibrate", "sensitivity_rows", "simulate_hetero", "scavenge_rows",
           "bandwidth_rows", "ClusterModel", "HeteroConfig", "ScavengeConfig", "BandwidthModel"]
