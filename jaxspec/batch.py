"""The public path of batch jobs (`from jaxspec.batch import JobSettings, run_job`); they live in
jaxspec.jobs."""

from jaxspec.jobs.job import run_job
from jaxspec.jobs.output import read_output
from jaxspec.jobs.records import BatchError, read_input
from jaxspec.jobs.settings import JobSettings

__all__ = ["BatchError", "JobSettings", "read_input", "read_output", "run_job"]
