output "store_url" {
  description = "The --store URL of the run: point `ddiloco-geo status` and `selfcheck` at it."
  value       = module.bucket.store_url
}

output "bucket_region" {
  description = "Home region of the bucket (learners elsewhere set storage.region to it)."
  value       = var.home_region
}

output "syncer_instance_id" {
  description = "The syncer VM (SSM Session Manager: `aws ssm start-session --target ID`)."
  value       = module.syncer.instance_id
}

output "learner_groups" {
  description = "Region -> auto scaling group of that region's learners (raise desired capacity to add learners)."
  value = {
    (var.home_region)   = module.learners_home.autoscaling_group_name
    (var.second_region) = module.learners_second.autoscaling_group_name
    (var.third_region)  = module.learners_third.autoscaling_group_name
  }
}

output "gcp_learner_role_arn" {
  description = "Role the optional GCP learners assume by web identity (input of examples/multi-region/gcp). Null without gcp_fleet."
  value       = var.gcp_fleet == null ? null : module.iam.learner_role_arns[var.gcp_fleet]
}
