#!/bin/bash
sed -i "s/(len(nums) + 1)/len(nums)/" /app/stats.py
