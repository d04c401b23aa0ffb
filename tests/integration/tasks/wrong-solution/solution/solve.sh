#!/bin/bash
echo 41 > /app/answer.txt  # deliberately wrong: this task must score 0
