output "autoscaling_group_name" {
  description = "Name of the learners' auto scaling group (set its desired capacity to grow or shrink the fleet)."
  value       = aws_autoscaling_group.learners.name
}

output "launch_template_id" {
  description = "ID of the learners' launch template."
  value       = aws_launch_template.learner.id
}

output "region" {
  description = "AWS region the fleet runs in."
  value       = data.aws_region.current.name
}

output "user_data" {
  description = "The rendered cloud-init user data (for review; contains no credentials)."
  value       = local.user_data
}
