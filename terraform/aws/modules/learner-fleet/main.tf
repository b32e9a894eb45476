# A learner fleet on spot capacity in one region: a launch template whose user data installs and
# starts the agent, and an auto scaling group with a mixed-instances, capacity-optimized policy,
# capacity rebalancing, and a termination lifecycle hook that gives the agent time to flush.

data "aws_region" "current" {}

data "aws_ssm_parameter" "image" {
  count = var.image_id == null ? 1 : 0
  name  = var.image_ssm_parameter
}

locals {
  deploy_dir = coalesce(var.deploy_dir, "${path.module}/../../../../deploy")
  hook_name  = "ddiloco-flush"
  image_id   = var.image_id != null ? var.image_id : nonsensitive(data.aws_ssm_parameter.image[0].value)
  name       = "ddiloco-${var.fleet}"

  env_file = templatefile("${local.deploy_dir}/env/ddiloco-geo.env.tmpl", {
    role          = "learner"
    run_id        = var.run_id
    store_url     = var.store_url
    bucket_region = var.bucket_region
    region        = coalesce(var.region_label, data.aws_region.current.name)
    extra_env     = join("\n", [for k, v in var.settings : "${k}=${v}"])
  })

  user_data = templatefile("${local.deploy_dir}/cloud-init/learner.yaml.tmpl", {
    cloud                 = "aws"
    fleet                 = var.fleet
    package_spec          = var.package_spec
    lifecycle_hook        = local.hook_name
    web_identity_role_arn = ""
    env_b64               = base64encode(local.env_file)
    unit_b64              = filebase64("${local.deploy_dir}/systemd/ddiloco-geo@.service")
    node_agent_unit_b64   = filebase64("${local.deploy_dir}/systemd/ddiloco-node-agent.service")
    node_setup_b64        = filebase64("${local.deploy_dir}/bin/ddiloco-node-setup")
    node_agent_b64        = filebase64("${local.deploy_dir}/bin/ddiloco-node-agent")
  })
}

resource "aws_launch_template" "learner" {
  name_prefix            = "${local.name}-"
  description            = "ddiloco-geo learner, fleet ${var.fleet}"
  image_id               = local.image_id
  user_data              = base64encode(local.user_data)
  vpc_security_group_ids = concat([aws_security_group.egress.id], var.security_group_ids)
  ebs_optimized          = true
  update_default_version = true

  iam_instance_profile {
    name = var.instance_profile_name
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "enabled"
  }

  monitoring {
    enabled = true
  }

  block_device_mappings {
    device_name = "/dev/sda1"

    ebs {
      volume_size           = var.root_volume_gb
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = local.name, "ddiloco-fleet" = var.fleet, "ddiloco-role" = "learner" })
  }

  tags = var.tags
}

resource "aws_autoscaling_group" "learners" {
  name_prefix         = "${local.name}-"
  vpc_zone_identifier = var.subnet_ids
  min_size            = var.min_size
  max_size            = var.max_size
  desired_capacity    = var.desired_capacity
  capacity_rebalance  = true
  health_check_type   = "EC2"

  mixed_instances_policy {
    instances_distribution {
      on_demand_base_capacity                  = var.on_demand_base_capacity
      on_demand_percentage_above_base_capacity = var.on_demand_percentage_above_base
      spot_allocation_strategy                 = "capacity-optimized"
    }

    launch_template {
      launch_template_specification {
        launch_template_id = aws_launch_template.learner.id
        version            = "$Latest"
      }

      dynamic "override" {
        for_each = var.instance_types

        content {
          instance_type = override.value
        }
      }
    }
  }

  # Created with the group, so no instance can launch before the hook exists.
  initial_lifecycle_hook {
    name                 = local.hook_name
    lifecycle_transition = "autoscaling:EC2_INSTANCE_TERMINATING"
    heartbeat_timeout    = var.lifecycle_hook_timeout_s
    default_result       = "CONTINUE"
  }

  dynamic "tag" {
    for_each = merge(var.tags, { "ddiloco-fleet" = var.fleet })

    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }

  lifecycle {
    # Scaling is the operator's (or an autoscaler's) business after the first apply.
    ignore_changes = [desired_capacity]
  }
}

data "aws_iam_policy_document" "lifecycle" {
  statement {
    sid       = "CompleteOwnLifecycleHook"
    actions   = ["autoscaling:CompleteLifecycleAction", "autoscaling:RecordLifecycleActionHeartbeat"]
    resources = [aws_autoscaling_group.learners.arn]
  }
}

resource "aws_iam_role_policy" "lifecycle" {
  name   = "lifecycle-hook-${var.fleet}"
  role   = var.role_name
  policy = data.aws_iam_policy_document.lifecycle.json
}

resource "aws_security_group" "egress" {
  name_prefix = "${local.name}-"
  description = "ddiloco-geo learner: no inbound, HTTPS/HTTP out (S3, package index)"
  vpc_id      = var.vpc_id
  tags        = var.tags

  egress {
    description = "HTTPS to S3, STS and the package index"
    from_port   = 443
    to_port     = 443
    protocol    = "tcp"
    cidr_blocks = ["0.0.0.0/0"]
  }

  egress {
    description = "HTTP to the OS package mirrors"
    from_port   = 80
    to_port     = 80
    protocol    = "tcp"
    cidr_blocks = ["0.0.0.0/0"]
  }

  lifecycle {
    create_before_destroy = true
  }
}
