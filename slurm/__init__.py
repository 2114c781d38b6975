"""sbatch templates (Jinja2) shipped inside the wheel as ``bufreuse.slurm``."""
