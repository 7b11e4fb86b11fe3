"""Every test runs on tinygrad's CPU device, whatever DEV the shell has (a test about another device sets it in the
subprocess it starts): the references, budgets and kernel heuristics here are the CPU's, and a DEV=NULL left in the
environment would otherwise turn the suite into a schedule-only run."""
import os, pathlib, sys

os.environ["DEV"] = "CPU"  # before anything imports tinygrad
sys.path.insert(0, str(pathlib.Path(__file__).parent))
