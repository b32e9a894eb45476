output "learner_role_arns" {
  description = "Fleet id -> ARN of that fleet's learner role."
  value       = { for fleet in var.learner_fleets : fleet => aws_iam_role.role["learner-${fleet}"].arn }
}

output "learner_role_names" {
  description = "Fleet id -> name of that fleet's learner role (attach extra policies, e.g. lifecycle-hook completion)."
  value       = { for fleet in var.learner_fleets : fleet => aws_iam_role.role["learner-${fleet}"].name }
}

output "learner_instance_profiles" {
  description = "Fleet id -> name of the instance profile for that fleet's VMs."
  value       = { for fleet in var.learner_fleets : fleet => aws_iam_instance_profile.role["learner-${fleet}"].name }
}

output "syncer_role_arn" {
  description = "ARN of the syncer role."
  value       = aws_iam_role.role["syncer"].arn
}

output "syncer_instance_profile" {
  description = "Name of the instance profile for the syncer VM."
  value       = aws_iam_instance_profile.role["syncer"].name
}

output "writer_principal_arns" {
  description = "Every role that may write to the bucket: pass to the bucket module's writer_principal_arns."
  value       = [for role in aws_iam_role.role : role.arn]
}

output "role_prefixes" {
  description = "Role key ('syncer' or 'learner-<fleet>') -> read and write prefixes relative to the run, as the policies grant them."
  value       = local.role_prefixes
}

output "policy_json" {
  description = "Role key -> the S3 policy document attached to that role."
  value       = { for role, doc in data.aws_iam_policy_document.role : role => doc.json }
}
