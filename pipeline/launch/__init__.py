"""Starting, watching and stopping a run's stages: Slurm jobs via submitit, or local processes.

`plan` decides what each stage runs and with which resources, `sbatch` renders the job scripts
(template in the repo's `slurm/`), `jobs` keeps `jobs.json`, `rundir` creates / resumes / cleans
the run dir, `slurm` and `local` are the two executors, `launcher` ties them together and
`status` reads a run back (`arl status`, `arl stop`).
"""
