__version__ = "0.1.0"


# %% ../nbs/00_core.ipynb #7753fce4
import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads OpenMP: waiting threads sleep (see dml_nb.core.base)
