@echo off
rem Start N ranks of a Python script on this machine:
rem   launch_distributed.bat 4 train.py [args...]
rem Same behaviour as launch_distributed.sh (python -m pycyxwiz.launch --help).
if "%~2"=="" (
  echo usage: %~nx0 NUM_PROCESSES script.py [args...]
  exit /b 2
)
set "CX_NPROC=%~1"
shift
set "CX_ARGS="
:collect
if "%~1"=="" goto run
set CX_ARGS=%CX_ARGS% %1
shift
goto collect
:run
python -m pycyxwiz.launch --nproc-per-node %CX_NPROC% -- %CX_ARGS%
exit /b %ERRORLEVEL%
