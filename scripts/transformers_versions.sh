# The transformers releases cbcore supports, read by scripts/install.sh and scripts/test.sh. The venv gets the first;
# the second lies beside it as an overlay ($VENV/alt/transformers-<version>: transformers and the packages it needs
# that the venv lacks, nothing else), put in front with PYTHONPATH to run the tests on it.
TRANSFORMERS=5.24.0
OTHER_TRANSFORMERS=5.25.0
OVERLAY="${CBCORE_VENV:-.venv}/alt/transformers-$OTHER_TRANSFORMERS"
