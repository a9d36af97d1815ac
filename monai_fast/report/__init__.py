"""Reports read from run results: the recipe race table and plots, and the doctor's diagnosis."""
