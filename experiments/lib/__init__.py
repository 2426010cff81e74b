"""What the experiment scripts share: the command line and RESULT line, paired (lockstep) runs and timings."""
